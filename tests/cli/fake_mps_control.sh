#!/bin/sh
# A stand-in for nvidia-cuda-mps-control (HSPMD_MPS_CONTROL) on machines
# without a GPU: records each call in $FAKE_MPS_LOG ("start PIPE LOG" for
# -d, the command read from stdin and the pipe directory otherwise).
if [ "$1" = "-d" ]; then
  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "${FAKE_MPS_LOG:-/dev/null}"
  exit 0
fi
read cmd
echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> "${FAKE_MPS_LOG:-/dev/null}"
