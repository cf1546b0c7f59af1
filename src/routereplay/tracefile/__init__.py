"""Trace files on disk: a codec file, a `.npy` or an engine response, recognised from its bytes.

Files:
- `io.py`       `read_trace` (bounded by `TraceFileLimits`) and `write_trace` (atomic, in any format)
- `format.py`   `FileFormat` and `sniff`: a file's format from its first bytes, or from its suffix
- `payload.py`  `PayloadHints` and engine payloads in each engine's wire form, with the carried
                `"routereplay"` object that names the layers, E and top-k
"""

from routereplay.tracefile.format import FileFormat, format_for_path, sniff
from routereplay.tracefile.io import TraceFileLimits, read_trace, write_trace
from routereplay.tracefile.payload import PayloadHints

__all__ = ["FileFormat", "PayloadHints", "TraceFileLimits", "format_for_path", "read_trace", "sniff", "write_trace"]
