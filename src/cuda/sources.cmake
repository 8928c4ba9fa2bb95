# CUDA backend sources (included from the top-level CMakeLists.txt when CUDA is on).
#
# Build-time budget: one translation unit per flash head dim (bf16 + f16 inside), so the 12
# kernels compile in parallel; nothing else is instantiated.
set(IOATTN_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/runtime.cu
  ${CMAKE_CURRENT_LIST_DIR}/naive.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_dispatch.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_fwd_hdim32.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_fwd_hdim64.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_fwd_hdim96.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_fwd_hdim128.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_fwd_hdim192.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_fwd_hdim256.cu
  # Backward (mma.sync): one TU per head dim of the backward table + the selector/launcher.
  ${CMAKE_CURRENT_LIST_DIR}/flash_bwd_dispatch.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_bwd_hdim64.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_bwd_hdim128.cu
  ${CMAKE_CURRENT_LIST_DIR}/flash_bwd_hdim256.cu
  # Serving: split-KV decode (FMA: 5 cache dtypes; mma: bf16/f16 x hdim 64/128/256) + merge, append_kv,
  # merge_states.
  ${CMAKE_CURRENT_LIST_DIR}/serving_decode.cu
  ${CMAKE_CURRENT_LIST_DIR}/serving_decode_mma.cu
  ${CMAKE_CURRENT_LIST_DIR}/serving_ops.cu
)
# The Hopper (sm_90a) wgmma/TMA kernel and its PTX unit tests / check harness.
include(${CMAKE_CURRENT_LIST_DIR}/hopper/sources.cmake)
list(APPEND IOATTN_CUDA_SOURCES ${IOATTN_SM90_SOURCES})

# Kernel resource report (registers, spills, smem) in the build log: -DIOATTN_PTXAS_VERBOSE=ON.
option(IOATTN_PTXAS_VERBOSE "Print ptxas resource usage for the CUDA kernels" OFF)
if(IOATTN_PTXAS_VERBOSE)
  set_source_files_properties(${IOATTN_CUDA_SOURCES} PROPERTIES COMPILE_OPTIONS "-Xptxas=-v")
endif()

# The CUDA executables are defined once the library target exists (this file is included right
# after add_library(ioattn)); they link the static library and its private CUDA dependencies.
function(ioattn_cuda_extras)
  if(IOATTN_BUILD_BENCH)
    add_executable(ioattn_cuda_bench ${PROJECT_SOURCE_DIR}/src/cuda/bench_main.cu)
    target_link_libraries(ioattn_cuda_bench PRIVATE ioattn::ioattn CUDA::cudart_static)
    target_include_directories(ioattn_cuda_bench PRIVATE ${PROJECT_SOURCE_DIR}/src)
    # Tile-variant sweep for tuning the traits (not part of `all`: gpu-check builds it on demand).
    add_executable(ioattn_cuda_tune EXCLUDE_FROM_ALL
      ${PROJECT_SOURCE_DIR}/src/cuda/flash_tune.cu ${PROJECT_SOURCE_DIR}/src/cuda/flash_tune_d64.cu
      ${PROJECT_SOURCE_DIR}/src/cuda/flash_tune_d128.cu ${PROJECT_SOURCE_DIR}/src/cuda/flash_tune_d256.cu)
    target_link_libraries(ioattn_cuda_tune PRIVATE ioattn::ioattn CUDA::cudart_static)
    target_include_directories(ioattn_cuda_tune PRIVATE ${PROJECT_SOURCE_DIR}/src)
    # Backward tile sweep (gpu-check stage bwdtune): not part of `all` either. ptxas -v is always
    # on: registers and spills per candidate are half of what the sweep is for.
    add_executable(ioattn_cuda_bwd_tune EXCLUDE_FROM_ALL
      ${PROJECT_SOURCE_DIR}/src/cuda/flash_bwd_tune.cu ${PROJECT_SOURCE_DIR}/src/cuda/flash_bwd_tune_d64.cu
      ${PROJECT_SOURCE_DIR}/src/cuda/flash_bwd_tune_d128.cu ${PROJECT_SOURCE_DIR}/src/cuda/flash_bwd_tune_d256.cu)
    target_link_libraries(ioattn_cuda_bwd_tune PRIVATE ioattn::ioattn CUDA::cudart_static)
    target_include_directories(ioattn_cuda_bwd_tune PRIVATE ${PROJECT_SOURCE_DIR}/src)
    target_compile_options(ioattn_cuda_bwd_tune PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
    # Read-bandwidth ceiling by load mechanism (ldg, cp.async +- L2 prefetch hints, 1-D bulk copy)
    # for the decode loader; Hopper only (gpu-check stage readbw; not part of `all`).
    add_executable(ioattn_cuda_readbw EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/src/cuda/bench_readbw.cu)
    set_target_properties(ioattn_cuda_readbw PROPERTIES CUDA_ARCHITECTURES 90a)
    target_link_libraries(ioattn_cuda_readbw PRIVATE CUDA::cudart_static)
    target_include_directories(ioattn_cuda_readbw PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
    # fp32 global-reduction ceiling (the backward's dQ); src/cuda/bench_redbw.cu says what it times.
    add_executable(ioattn_cuda_redbw EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/src/cuda/bench_redbw.cu)
    set_target_properties(ioattn_cuda_redbw PROPERTIES CUDA_ARCHITECTURES 90a)
    target_link_libraries(ioattn_cuda_redbw PRIVATE CUDA::cudart_static)
    # Decode benchmark (JSON lines; bench/peer_decode.py runs it next to torch SDPA).
    add_executable(ioattn_cuda_decode_bench ${PROJECT_SOURCE_DIR}/src/cuda/bench_decode_cuda.cu)
    target_link_libraries(ioattn_cuda_decode_bench PRIVATE ioattn::ioattn CUDA::cudart_static)
    target_include_directories(ioattn_cuda_decode_bench PRIVATE ${PROJECT_SOURCE_DIR}/src)
  endif()
  if(IOATTN_BUILD_TESTS)
    find_package(GTest CONFIG QUIET)
    if(NOT GTest_FOUND)
      find_package(GTest QUIET)
    endif()
    if(GTest_FOUND)
      enable_testing()
      add_executable(test_cuda_kernels ${PROJECT_SOURCE_DIR}/tests/test_cuda_kernels.cpp)
      target_link_libraries(test_cuda_kernels PRIVATE ioattn::ioattn GTest::gtest GTest::gtest_main)
      target_include_directories(test_cuda_kernels PRIVATE ${PROJECT_SOURCE_DIR}/src)
      add_test(NAME cuda_kernels COMMAND test_cuda_kernels)
      # The sm90 forward's kLocal rows (sliding windows, sinks, softcap, ALiBi, varlen) are the default
      # on sm_90: those cases again with them switched off, so the mma.sync path keeps its coverage there.
      add_test(NAME cuda_kernels_mma_local
               COMMAND test_cuda_kernels --gtest_filter=*window*:*sinks*:*softcap*:*alibi*:*varlen*:*local_*)
      set_tests_properties(cuda_kernels_mma_local PROPERTIES ENVIRONMENT "IOATTN_SM90_LOCAL=0")
      # ... and on 2 persistent CTAs, so every CTA walks many tiles (empty varlen tiles between
      # full ones, the ring and the tile slot carried across tiles).
      add_test(NAME cuda_kernels_sm90_local_2ctas COMMAND test_cuda_kernels --gtest_filter=*local_*:*varlen*)
      set_tests_properties(cuda_kernels_sm90_local_2ctas PROPERTIES ENVIRONMENT "IOATTN_SM90_MAX_CTAS=2")
      # Q K^T with Q in registers is the hdim-128 causal rows' default: the causal and hdim-128
      # cases again without it. On sm_90 the test checks each plain hdim-128 row ran what the
      # switch asks.
      add_test(NAME cuda_kernels_sm90_noqregs COMMAND test_cuda_kernels --gtest_filter=*causal*:*hdim128*)
      set_tests_properties(cuda_kernels_sm90_noqregs PROPERTIES ENVIRONMENT "IOATTN_SM90_QREGS=0")
      # The plain rows on 3 persistent CTAs: every CTA walks many tiles (the multi-tile cases, causal
      # tiles with no visible key between ones with keys, hdim 64 / 128 / 256).
      add_test(NAME cuda_kernels_sm90_3ctas COMMAND test_cuda_kernels --gtest_filter=*tiles_*:*1023x1024*:*seq17*:*bhsd*:*causal*)
      set_tests_properties(cuda_kernels_sm90_3ctas PROPERTIES ENVIRONMENT "IOATTN_SM90_MAX_CTAS=3")
      # Causal query blocks aligned to the sequence's end are the causal default since session 13;
      # IOATTN_SM90_ALIGN_END=0 (blocks from row 0): the causal and multi-tile cases against the reference.
      add_test(NAME cuda_kernels_sm90_alignend COMMAND test_cuda_kernels --gtest_filter=*causal*:*tiles_*:*1023x1024*)
      set_tests_properties(cuda_kernels_sm90_alignend PROPERTIES ENVIRONMENT "IOATTN_SM90_ALIGN_END=0")
      # L2 scheduling sections of 1 MB (IOATTN_SM90_L2_SECTION_MB, session 34's knob for the section
      # sweep; tile order only): many sections with a partial last one, on 3 persistent CTAs.
      add_test(NAME cuda_kernels_sm90_l2section COMMAND test_cuda_kernels --gtest_filter=*tiles_*:*1023x1024*:*bhsd*:*causal*)
      set_tests_properties(cuda_kernels_sm90_l2section PROPERTIES ENVIRONMENT "IOATTN_SM90_L2_SECTION_MB=1;IOATTN_SM90_MAX_CTAS=3")
      # The rotated (staggered) non-causal key order, off by default since session 35: the multi-tile
      # and odd-length cases with it on, on 3 persistent CTAs.
      add_test(NAME cuda_kernels_sm90_stagger COMMAND test_cuda_kernels --gtest_filter=*tiles_*:*1023x1024*:*seq17*:*bhsd*:*hdim*)
      set_tests_properties(cuda_kernels_sm90_stagger PROPERTIES ENVIRONMENT "IOATTN_SM90_STAGGER=1;IOATTN_SM90_MAX_CTAS=3")
      # A GPU-less machine prints "skipped: no CUDA device"; ctest reports those as skipped.
      set_tests_properties(cuda_kernels cuda_kernels_mma_local cuda_kernels_sm90_local_2ctas cuda_kernels_sm90_noqregs cuda_kernels_sm90_3ctas
                           cuda_kernels_sm90_alignend cuda_kernels_sm90_l2section cuda_kernels_sm90_stagger
                           PROPERTIES SKIP_REGULAR_EXPRESSION "skipped: no CUDA device")
      add_executable(test_cuda_backward ${PROJECT_SOURCE_DIR}/tests/test_cuda_backward.cpp)
      target_link_libraries(test_cuda_backward PRIVATE ioattn::ioattn GTest::gtest GTest::gtest_main)
      target_include_directories(test_cuda_backward PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
      add_test(NAME cuda_backward COMMAND test_cuda_backward)
      set_tests_properties(cuda_backward PROPERTIES SKIP_REGULAR_EXPRESSION "skipped: no CUDA device")
      add_executable(test_cuda_serving ${PROJECT_SOURCE_DIR}/tests/test_cuda_serving.cpp)
      target_link_libraries(test_cuda_serving PRIVATE ioattn::ioattn GTest::gtest GTest::gtest_main CUDA::cudart_static)
      target_include_directories(test_cuda_serving PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
      add_test(NAME cuda_serving COMMAND test_cuda_serving)
      set_tests_properties(cuda_serving PROPERTIES SKIP_REGULAR_EXPRESSION "skipped: no CUDA device")
    else()
      message(STATUS "ioattn: GoogleTest not found; test_cuda_kernels not built")
    endif()
  endif()
endfunction()
cmake_language(DEFER DIRECTORY ${PROJECT_SOURCE_DIR} CALL ioattn_cuda_extras)
