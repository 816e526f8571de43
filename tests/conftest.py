import os
import sys

# tests import the package from the checkout even without an install
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
