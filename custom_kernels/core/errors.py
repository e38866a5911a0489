"""Exceptions of cutlass-ops. Each names the problem and, where there is one, the way out."""


class CutlassOpsError(RuntimeError):
    """Base class."""


class UnsupportedInputError(CutlassOpsError, ValueError):
    """Tensors this library cannot run: wrong device, dtype mix, shapes, strides or alignment."""


class InvalidConfigError(CutlassOpsError, ValueError):
    """A GemmConfig that cannot compile or run for the problem; the message gives the rule."""


class EmissionError(CutlassOpsError):
    """cutlass_cppgen could not emit a kernel for a config."""


class BuildError(CutlassOpsError):
    """nvcc failed; carries the config name and the path of the kept log."""

    def __init__(self, name: str, log_path: str, summary: str = ""):
        self.name = name
        self.log_path = log_path
        detail = f": {summary}" if summary else ""
        super().__init__(f"building {name} failed{detail} (full log: {log_path})")


class ToolchainError(CutlassOpsError):
    """nvcc or the CUTLASS sources are missing."""


class KernelLaunchError(CutlassOpsError):
    """A built kernel refused the problem or failed to launch."""


class UnsafeCacheError(CutlassOpsError):
    """Compiled code (a shared object or a cubin) in a cache that another user can write to or
    owns: loading it would run whatever they put there. ``path`` is the file or directory at
    fault; the message says how to fix its permissions."""

    def __init__(self, message: str, path: str = ""):
        self.path = path
        super().__init__(message)
