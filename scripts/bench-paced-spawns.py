#!/usr/bin/env python3
"""Spawns at a steady pace from a pool, with its refills running: what a
user sees between bursts (docs/BENCHMARKS.md, "Parking children in swap").

    scripts/bench-paced-spawns.py TAG N GAP_SECONDS POOL_SPEC_JSON

Sizes TAG's pool with POOL_SPEC_JSON, waits until it is full, then N times:
spawn one child, one eval, delete it, sleep GAP_SECONDS; removes the pool
and prints one JSON line (spawn p50/max, first eval p50, the pool's resident
children before each spawn). poold at $FORKD_URL (default 127.0.0.1:8899).
"""
import os
import json,time,urllib.request,sys,statistics
B=os.environ.get('FORKD_URL','http://127.0.0.1:8899')
def req(m,p,b=None):
    r=urllib.request.Request(B+p,data=json.dumps(b).encode() if b is not None else None,headers={'content-type':'application/json'},method=m)
    with urllib.request.urlopen(r,timeout=120) as f:
        t=f.read(); return json.loads(t) if t else None
tag,n,gap=sys.argv[1],int(sys.argv[2]),float(sys.argv[3])
spec=json.loads(sys.argv[4])
req('PUT',f'/v1/pools/{tag}',spec)
while req('GET',f'/v1/pools/{tag}')['ready']<spec['min_ready']: time.sleep(1)
time.sleep(3)
sp=[];fe=[];res=[]
for i in range(n):
    st=req('GET',f'/v1/pools/{tag}'); res.append(st.get('resident'))
    t0=time.perf_counter(); sb=req('POST','/v1/sandboxes',{'snapshot_tag':tag})[0]; t1=time.perf_counter()
    req('POST',f"/v1/sandboxes/{sb['id']}/eval",{'code':'numpy.zeros(5).tolist()'}); t2=time.perf_counter()
    sp.append((t1-t0)*1000); fe.append((t2-t1)*1000)
    req('DELETE',f"/v1/sandboxes/{sb['id']}")
    time.sleep(gap)
req('DELETE',f'/v1/pools/{tag}')
print(json.dumps({'spec':spec,'gap_s':gap,'n':n,'spawn_p50_ms':statistics.median(sp),'spawn_max_ms':max(sp),'first_eval_p50_ms':statistics.median(fe),'resident_before_each':res}))
