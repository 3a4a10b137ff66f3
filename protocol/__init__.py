"""deltacast wire protocol: pure vocabulary, codec and state machines.

Nothing in this package opens sockets or imports torch (except
``protocol.tensors``, which handles tensors).
"""

PROTOCOL_VERSION = (3, 0)
