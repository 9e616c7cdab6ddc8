"""Active health checks of the load balancer's backends."""
