"""What a checkpoint is on disk: checksums, data layout, the tagged-JSON codec, the rank file format, its writer, the manifest and the global index."""
