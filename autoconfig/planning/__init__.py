"""Cluster planning (``autoconfig plan``): services' pools sized, placed on a node list, and the resources the
placement strands. Ray-free: numpy, pydantic and PyYAML only.

``inputs`` reads files and names the line and column of a bad value; ``cluster`` the node list; ``services`` the
instances to place (Prism-format trace rows, or pools measured by ``autoconfig profile``) in a layout;
``fragmentation`` what a placement strands; ``placement`` the policies; ``plan`` ties them together; ``serve_plan``
writes the Serve config and KubeRay worker groups that realise a plan. Definitions: docs/AUTOCONFIG.md ("Planning a
cluster").
"""
