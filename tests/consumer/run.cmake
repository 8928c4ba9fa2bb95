# cmake -DBIN=<build> -DSRC=<source> -DGEN=<generator> [-DEXTRA=<prefix path of the deps>] -P run.cmake
set(prefix ${BIN}/install-test/prefix)
set(build ${BIN}/install-test/consumer)

function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install test step failed (${rc}): ${ARGN}\n${err}")
  endif()
endfunction()

step(${CMAKE_COMMAND} --install ${BIN} --prefix ${prefix})
string(REPLACE ";" "\\;" deps "${EXTRA}")
step(${CMAKE_COMMAND} -S ${SRC}/tests/consumer -B ${build} -G ${GEN} -DCMAKE_BUILD_TYPE=Release
     "-DCMAKE_PREFIX_PATH=${prefix}\\;${deps}")
step(${CMAKE_COMMAND} --build ${build})
step(${build}/app)
