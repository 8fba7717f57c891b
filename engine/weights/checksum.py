"""CRC32 with zlib's polynomial (the manifest's checksums), at memory speed.

Every record the expert store reads and every chunk of a streamed layer is
checked as it lands. zlib's own crc32 runs at ~4 GB/s here: 34% of the CPU time
of the cap bench's decode, which reads ~300 MB a token. ISA-L's (the `isal`
package: carry-less multiply on x86 and ARM) gives the same values at 21-57 GB/s
and, like zlib's, releases the GIL. zlib's where isal is not installed.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; a platform without its wheel
    from zlib import crc32

__all__ = ["crc32"]
