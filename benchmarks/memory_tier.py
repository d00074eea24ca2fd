"""The memory tier beside DLRover's flash checkpoint (also ``unickpt bench --memory-tier``).

python benchmarks/memory_tier.py --mib 256 --peers-python .venv-peers/bin/python
"""

from unickpt.bench.memory_tier import main

if __name__ == "__main__":
    main()
