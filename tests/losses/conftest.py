"""Puts tests/ on sys.path so that loss tests can import the shared ``_host_sync`` helper."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
