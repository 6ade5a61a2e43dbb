"""Pipeline schedules as data: the action IR, its generators and validation."""
