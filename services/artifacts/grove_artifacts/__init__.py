"""The artifact-store: blobs in the JetStream object store, their index in SQL."""
