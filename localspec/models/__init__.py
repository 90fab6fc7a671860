"""Models: naming and loading them (``loading``), the built-in checkpoints (``builtin``), the
on-disk cache of assembled and converted files (``cache``), and what a preset needs in memory
against what this machine has (``hardware``)."""
