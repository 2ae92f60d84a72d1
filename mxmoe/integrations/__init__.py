"""mxmoe under other libraries' models (optional dependencies, imported only by the submodule that needs them):
``mxmoe.integrations.transformers`` (``pip install "mxmoe[hf]"``)."""
