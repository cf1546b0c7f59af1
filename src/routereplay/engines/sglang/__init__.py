"""The routereplay SGLang plugin (SGLang 0.5.23): route forcing in `forcing/`."""
