"""The bottom layer: errors and exit statuses, atomic writes and checked readers, logging set-up.

Every other package may import this one; it imports nothing of the project.
"""
