"""The codec: a RouteTrace as a compact, versioned, checksummed blob, and random access into one.

Files:
- `blob.py`           `encode` / `decode` / `header_info`: the whole blob; set mode ranks each row's
                      K-subset (ceil(log2 C(E, K)) bits per row), ordered mode keeps the id order
- `header.py`         the envelope and header: magic, version, flags, shape, layers, CRC
- `rows.py`           the payload: rows encoded, and decoded in bounded steps straight into the output
- `limits.py`         `CodecLimits`: ids, expansion and set-table bounds, checked before allocating
- `subsets.py`        the combinatorial number system: K-subsets <-> ranks (uint64 or exact ints)
- `column_search.py`  the unranker's column searches: float64 buckets, bucket search, the low-id table
- `ranker.py`         the numpy set-mode ranker: a sorting network over K columns, pair tables
- `native.py`         the C kernel (`set_kernel.c`, built at install): validate + rank + pack, and
                      read + check + unrank, on blocks of rows; numpy is the fallback and reference
- `encoded.py`        `EncodedRoutes`: a resident blob read by row range, and cut into spans unread

`docs/codec.md` describes the format; `docs/limits.md` the bounds.
"""

from routereplay.codec.blob import bits_per_row, decode, encode, entropy_bits_per_row, header_info
from routereplay.codec.encoded import EncodedRoutes, EncodedSpan
from routereplay.codec.header import CodecHeader
from routereplay.codec.limits import CodecLimits

__all__ = [
    "CodecHeader",
    "CodecLimits",
    "EncodedRoutes",
    "EncodedSpan",
    "bits_per_row",
    "decode",
    "encode",
    "entropy_bits_per_row",
    "header_info",
]
