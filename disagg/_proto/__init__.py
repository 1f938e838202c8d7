"""Code generated from ``disagg/proto/`` by ``scripts/gen_proto.py``; regenerate, never edit."""
