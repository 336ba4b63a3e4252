"""The unit tier (`make test-fast`): no TorchServe process, no Java, no Docker, no package index.
The engine with the demo model, the handler in-process, the front and the local endpoint over
stand-in servers on loopback: seconds to a minute or two."""
