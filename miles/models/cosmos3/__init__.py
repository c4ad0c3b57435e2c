"""The `cosmos3` family (Cosmos3OmniPipeline); its tiny build is `miles.builtin.tiny.cosmos3`."""
