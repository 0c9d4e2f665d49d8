"""The demo world: a synthetic task built deterministically (`world`), its locations and settings
(`locations`), and the reward functions (`rewards`) and tools (`tools`) its configs name."""
