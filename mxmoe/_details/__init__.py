"""Private Triton kernels and their launch plan (see ``launch``)."""
import os


def interpreting() -> bool:
    """True when Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``, read at call time;
    Triton itself reads it when the kernels are defined, at ``import mxmoe``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
