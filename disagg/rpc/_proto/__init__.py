"""Code generated from ``disagg/rpc/proto/`` by ``scripts/gen_proto.py``; regenerate, never edit."""
