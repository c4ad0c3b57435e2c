"""The `cosmos3` family (Cosmos3OmniPipeline) and its embedded tiny build."""
