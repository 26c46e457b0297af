"""The fused CPU op against the PyTorch reference, one module per stage of csrc/dgc (cpu_common.h lists them)."""

OTHER_FORMATS = ["int2", "int1", "fp8_e4m3", "fp8_e5m2"]

def _leb(v):
    out = []
    while v >= 128:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return out + [v]
