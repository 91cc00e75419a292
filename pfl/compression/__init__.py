"""Communication compression: compressors (:mod:`.compressors`) and where they act on messages
(:mod:`.codec`, a wire stage). Configured by the ``compression`` section (``compression.uplink`` /
``compression.downlink``: ``{name, ...params}``, ``compression.error_feedback``,
``compression.min_numel``) and checked in one place (:mod:`.checks`); see ``pfl compressors`` for
every name and parameter."""

from .codec import Codec, compress_tensor, compressible, decode_update, encode_update, message_bits, spec_omega
from .compressors import COMPRESSORS, NAMES, Compressor, CompressorSpec, build, contractive, index_bits, resolve_spec

__all__ = ["COMPRESSORS", "NAMES", "Codec", "Compressor", "CompressorSpec", "build", "compress_tensor", "compressible",
           "contractive",
           "decode_update", "encode_update", "index_bits", "message_bits", "resolve_spec", "spec_omega"]
