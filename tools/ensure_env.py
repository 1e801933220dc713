"""Make the running Python able to run mxval without touching its torch or triton.

Used by `make` when the running Python already imports torch and triton (a ROCm or CUDA
image, the GPU machine): whatever pure-Python dependency is missing is installed with
torch and triton pinned to the versions already there, so pip can never replace them.
Nothing is installed when everything imports (the GPU machine has no network).
"""
import importlib.util
import subprocess
import sys
import tempfile

NEEDED = {  # import name -> distribution
    "numpy": "numpy", "safetensors": "safetensors", "pandas": "pandas", "rich": "rich",
    "matplotlib": "matplotlib", "pytest": "pytest",
}
OPTIONAL = {"ml_dtypes": "ml-dtypes", "xdist": "pytest-xdist"}  # tests use them when present


def main() -> int:
    import torch
    import triton

    missing = [dist for mod, dist in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        absent = [d for m, d in OPTIONAL.items() if importlib.util.find_spec(m) is None]
        print(f"mxval: using this Python's torch {torch.__version__} and triton {triton.__version__}"
              + (f" (optional, absent: {', '.join(absent)})" if absent else ""))
        return 0
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"torch=={torch.__version__}\ntriton=={triton.__version__}\n")
    print(f"mxval: installing {', '.join(missing)} with torch {torch.__version__} pinned")
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", "-c", f.name, *missing])


if __name__ == "__main__":
    sys.exit(main())
