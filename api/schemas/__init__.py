"""Request/response schemas, one module per entity (``XCreate``, ``XPublic``, ``XsPublic``)."""
