"""Mesh axes by role, the logical-axis rules table, and the sharding report."""
