"""Code generated from ``disagg/api/proto/`` by ``scripts/gen_proto.py``; regenerate, never edit."""
