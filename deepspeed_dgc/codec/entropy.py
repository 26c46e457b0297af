"""Entropy coding of whole payloads (``dgc.entropy_coding: "zlib"``): lossless, on the host.

Quantized codes of gradients are far from uniform (most values fall in the inner levels of an
absmax-scaled grid), so Huffman coding of their bytes shrinks INT2 and INT4 codes of heavy-tailed values
(Gaussian to Student-t; tests/unit/codec/test_entropy.py requires at least 15% and 5%); random-looking parts
(fp32 scales, INT1 signs) pass through at about their size. What it saved on codes: results/figures.md; in
training: results/study_convergence.md.
"""

import zlib

import torch

from .wire import DGCProtocolError

ZLIB_LEVEL = 1  # DEFLATE's fastest level: the Huffman stage, which is what codes skewed INT2/INT4 codes, is the same


def deflate(payload: torch.Tensor) -> torch.Tensor:
    """Entropy-code one uint8 payload with DEFLATE (zlib, RFC 1950/1951: LZ77 then Huffman codes), lossless.

    Runs on the host: a device payload is copied there and back.

    Args:
        payload: 1-D uint8 tensor (any device).

    Returns:
        1-D uint8 tensor on the same device holding the zlib stream.
    """
    data = zlib.compress(payload.cpu().numpy().tobytes(), ZLIB_LEVEL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(payload.device)


def inflate(stream: torch.Tensor, src: int) -> torch.Tensor:
    """Undo :func:`deflate` for what rank ``src`` sent.

    Args:
        stream: 1-D uint8 tensor (any device), a zlib stream.
        src: the sender's rank in the communicator (named in the error).

    Returns:
        1-D uint8 tensor on the same device: the payload as it was before :func:`deflate`.

    Raises:
        DGCProtocolError: the bytes are not a zlib stream (the sender does not entropy-code: configs differ).
    """
    try:
        data = zlib.decompress(stream.cpu().numpy().tobytes())
    except zlib.error as err:
        raise DGCProtocolError(f"rank {src} sent a payload that is not a zlib stream ({err}): 'dgc.entropy_coding' "
                               "differs between ranks") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(stream.device)
