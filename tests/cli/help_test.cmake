# Every subcommand answers --help on stdout with exit code 0.
foreach(cmd "" train tokenize data "data stats")
  separate_arguments(words UNIX_COMMAND "${cmd}")
  execute_process(COMMAND ${HSPMD} ${words} --help RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "usage: hspmd")
    message(FATAL_ERROR "hspmd ${cmd} --help failed (rc=${rc}): ${out}")
  endif()
endforeach()
