# Hopper (sm_90a) forward kernel: TMA + wgmma, warp-specialised (src/cuda/hopper/).
#
# Included from src/cuda/sources.cmake:
#   include(${CMAKE_CURRENT_LIST_DIR}/hopper/sources.cmake)
#   list(APPEND IOATTN_CUDA_SOURCES ${IOATTN_SM90_SOURCES})
# Defines IOATTN_SM90_SOURCES (library sources: the selector/launcher and one translation unit per
# head_dim, so the 12 kernels compile in parallel) and, with IOATTN_BUILD_TESTS, two GPU programs
# registered with CTest (both print "skipped: no CUDA device" and exit 0 on a machine without a
# GPU, or "skipped: ..." on a GPU that is not sm_90; CTest reports those as skipped):
#   ioattn_test_ptx_sm90  one unit test per PTX wrapper of ptx_sm90.cuh
#   ioattn_sm90_check     correctness vs a float64 reference on odd shapes (--check-only here);
#                         without flags it also times the kernel (see peer_sdpa.py for the peers)
# and ioattn_sm90_wgmma_rate (not a test: cycles per wgmma by shape and operand source).
# The kernel bodies exist only in the sm_90a image (CUDA archs must include 90a, e.g. "80;90a");
# in an sm_80-only build sm90_flash_select answers false with the reason.
set(IOATTN_SM90_DIR ${CMAKE_CURRENT_LIST_DIR})
set(IOATTN_SM90_SOURCES
  ${IOATTN_SM90_DIR}/flash_fwd_sm90.cu
  ${IOATTN_SM90_DIR}/flash_fwd_sm90_hdim64.cu
  ${IOATTN_SM90_DIR}/flash_fwd_sm90_hdim128.cu
  ${IOATTN_SM90_DIR}/flash_fwd_sm90_hdim256.cu
  ${IOATTN_SM90_DIR}/flash_fwd_sm90_fp8.cu
  ${IOATTN_SM90_DIR}/flash_bwd_sm90.cu
)

function(ioattn_sm90_extras)
  if(NOT IOATTN_BUILD_TESTS)
    return()
  endif()
  add_executable(ioattn_test_ptx_sm90 ${IOATTN_SM90_DIR}/test_ptx_sm90.cu)
  set_target_properties(ioattn_test_ptx_sm90 PROPERTIES CUDA_ARCHITECTURES 90a)
  target_include_directories(ioattn_test_ptx_sm90 PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
  # (ioattn for the host's tensor-map builders, make_ragged_map)
  target_link_libraries(ioattn_test_ptx_sm90 PRIVATE ioattn::ioattn CUDA::cudart_static)
  add_test(NAME ptx_sm90 COMMAND ioattn_test_ptx_sm90)

  add_executable(ioattn_sm90_check ${IOATTN_SM90_DIR}/sm90_check.cu)
  set_target_properties(ioattn_sm90_check PROPERTIES CUDA_ARCHITECTURES 90a)
  target_include_directories(ioattn_sm90_check PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(ioattn_sm90_check PRIVATE ioattn::ioattn CUDA::cudart_static)
  add_test(NAME sm90_check COMMAND ioattn_sm90_check --check-only)
  # The same checks with 3 CTAs: every CTA walks many tiles through the cross-tile pipeline.
  add_test(NAME sm90_check_3ctas COMMAND ioattn_sm90_check --check-only)
  set_tests_properties(sm90_check_3ctas PROPERTIES ENVIRONMENT "IOATTN_SM90_MAX_CTAS=3")
  # The dynamic tile scheduler, O-rescale skip, 3-consumer-warpgroup rows and the v4 body for
  # hdim128, on 3 CTAs (many claims per CTA), whatever the table's defaults are.
  add_test(NAME sm90_check_dynamic COMMAND ioattn_sm90_check --check-only)
  set_tests_properties(sm90_check_dynamic PROPERTIES ENVIRONMENT
    "IOATTN_SM90_GRID=dynamic;IOATTN_SM90_MAX_CTAS=3;IOATTN_SM90_RESCALE_SKIP=1;IOATTN_SM90_WG3=1;IOATTN_SM90_BODY=v4")
  # The fp8 forward's 128x128 row (the default is 128x192 since session 15).
  add_test(NAME sm90_check_fp8n128 COMMAND ioattn_sm90_check --check-only --fp8-only)
  set_tests_properties(sm90_check_fp8n128 PROPERTIES ENVIRONMENT "IOATTN_SM90_FP8_BLOCKN=128")
  # The fp8 hdim-128 non-causal 2-warpgroup row (128x192; the default is 3 warpgroups since session 22).
  add_test(NAME sm90_check_fp8_2wg COMMAND ioattn_sm90_check --check-only --fp8-only)
  set_tests_properties(sm90_check_fp8_2wg PROPERTIES ENVIRONMENT "IOATTN_SM90_FP8_WG3=0")
  set_tests_properties(ptx_sm90 sm90_check sm90_check_3ctas sm90_check_dynamic sm90_check_fp8n128 sm90_check_fp8_2wg
    PROPERTIES
    SKIP_REGULAR_EXPRESSION "skipped: ")
  # Not a test: the wgmma rate per shape and operand source (gpu-check stage wgmmarate).
  add_executable(ioattn_sm90_wgmma_rate ${IOATTN_SM90_DIR}/bench_wgmma_sm90.cu)
  set_target_properties(ioattn_sm90_wgmma_rate PROPERTIES CUDA_ARCHITECTURES 90a)
  target_include_directories(ioattn_sm90_wgmma_rate PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
  target_link_libraries(ioattn_sm90_wgmma_rate PRIVATE CUDA::cudart_static)
endfunction()
cmake_language(DEFER DIRECTORY ${PROJECT_SOURCE_DIR} CALL ioattn_sm90_extras)
