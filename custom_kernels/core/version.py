__version__ = "0.1.0"

# The oldest releases a test of this project has run on (pyproject.toml's lower bounds say the
# same; `cutlass-tune doctor` names an older one): torch 2.11 on the GPU machines (DTensor
# sharding rules, blockwise torch._scaled_mm, torch._grouped_mm), 2.13 in CI; transformers 5.17.
OLDEST_TORCH = (2, 11)
OLDEST_TRANSFORMERS = (5, 17)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "2.11.0+cu130" or "5.17.0.dev0"."""
    major, minor = (version.split("+")[0].split(".") + ["0", "0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
