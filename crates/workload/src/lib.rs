//! Request streams for the simulator and the load generator.
