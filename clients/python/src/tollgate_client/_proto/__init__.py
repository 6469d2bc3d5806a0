"""gRPC stubs generated from tollgate.proto (filled in when the package builds)."""
