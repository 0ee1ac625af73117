"""pagecast.builder: enginebuild's passes, from a Hugging Face checkpoint to an engine artifact."""
