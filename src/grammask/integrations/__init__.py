"""Thin adapters from host frameworks to ``grammask.decode.processor.BatchProcessor``.

Each adapter only translates the host's batch bookkeeping and token delivery; masking, the
thinking gate, error handling and the fill worker all live in the processor.
"""
