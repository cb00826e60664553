"""The trainer side: the one push routine (:mod:`.bridge_client`), a client per way of running
vLLM, the engines the library starts, and vLLM's trainer API. Imports no vLLM until an engine is
started."""
