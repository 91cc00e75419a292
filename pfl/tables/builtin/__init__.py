"""The hooks of the tables that come with pfl (tables/*.yaml), one module per table."""
