"""Weight-sharing transports behind one export/attach API: CUDA IPC on GPUs, POSIX shared memory on the CPU."""
