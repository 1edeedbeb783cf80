"""Optional plug-ins that put cute-flash behind other libraries' attention entry points. Nothing in the core package
imports them, and the libraries they plug into are not dependencies of cute-flash:

    cute_flash.integrations.transformers.register(name="cute_attn")   # transformers' AttentionInterface
    cute_flash.integrations.sdpa.register(name="cute_flash")           # torch SDPA's flash backend (torch >= 2.9)

See docs/torch.md ("Plug-ins").
"""
