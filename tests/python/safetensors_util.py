"""F32 safetensors files for the Python tests (no safetensors package needed)."""
import json
import struct

import numpy


def write_safetensors(path, tensors):
    """Writes {name: array} as F32 safetensors, names in sorted order."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        b = numpy.ascontiguousarray(tensors[name], dtype=numpy.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
