#!/usr/bin/env bash
# norm_a.sh (GPU norm tests, sanitizers), then the RMSNorm register-cap comparison (regcap.sh).
bash devrun/norm_a.sh
KINDS=rms bash devrun/regcap.sh 2>&1 | grep -v "pip"
