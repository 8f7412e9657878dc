"""Test devices for protrain, outside the runtime: ``emulation`` makes the CPU copy engine
asynchronous (an adversary of the GPU for tests). The executor imports nothing from here
unless ``PROTRAIN_ASYNC_CPU`` is set or a test turned the emulation on."""
