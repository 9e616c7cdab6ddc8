"""The lab: a NAT gateway in network namespaces (topology), real traffic through it
(traffic), and the demo `make run` shows. Used by the demo, the netns tests and the
benchmark; never shipped (the wheel and the image hold agent/ only)."""
