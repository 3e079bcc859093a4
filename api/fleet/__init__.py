"""The fleet as the API shows it: node pools and their capacity, the placement
estimate, GPU usage, their routes and schemas.
"""
