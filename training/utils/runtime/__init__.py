"""The process a run lives in: OpenMP and malloc, the garbage collector, the loop watchdog, torchrun, the CPU the
engine and trainer share, memory, and the machine's measured peaks."""
