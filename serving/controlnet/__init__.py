"""ControlNets: models and presets, conditioning images, and the runner shared by in-process and
Serve-deployed ControlNet services."""
