#!/usr/bin/env python3
"""How far a float64 forward of the default model is from llama.cpp (and from tessera).

SmolLM2-135M-Instruct Q4_1, its weights dequantized by gguf-py, run in numpy float64 (no 8-bit
activations) on the prompt of tests/fixtures/smollm2/llama_cpp_logits.safetensors; prints the NMSE
of its logits against llama.cpp's and, if /tmp/t.npy holds `tessera logits --kv-cache f32` of the
same prompt, against ours. Measured 2026-12-01: float64 vs llama.cpp 1.3e-3 (last 4 rows), tessera
vs llama.cpp 1.5e-3: on 30 layers the 8-bit rounding noise is the gap, which is why the SmolLM2
NMSE test checks the model and not the arithmetic. `--rope-base 10000` shows what a wrong model
scores (4e-2).

  python tools/reference/smollm2_float64_gap.py [--rope-base B]
"""
import argparse
import os
import gguf
import llama_cpp
import numpy as np
from gguf.quants import dequantize
from safetensors.numpy import load_file

ap = argparse.ArgumentParser()
ap.add_argument("--rope-base", type=float, default=None)
ARGS = ap.parse_args()
path="models/SmolLM2-135M-Instruct.Q4_1.gguf"
r=gguf.GGUFReader(path)
W={}
for t in r.tensors:
    a=dequantize(t.data, t.tensor_type).astype(np.float64)
    W[t.name]=a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim==1 and len(t.shape)>1 else a
def f(k):
    v=r.fields[k]; return v.parts[v.data[0]].tolist()[0]
H=576; L=30; nh=9; nkv=3; hd=64; eps=f('llama.attention.layer_norm_rms_epsilon'); theta=ARGS.rope_base or f('llama.rope.freq_base')
print(eps, theta, W['token_embd.weight'].shape, W['blk.0.attn_q.weight'].shape)
fx=load_file("tests/fixtures/smollm2/llama_cpp_logits.safetensors")
ids=fx["prompt_ids"].tolist(); T=len(ids)
def rms(x,w): return x/np.sqrt((x*x).mean(-1,keepdims=True)+eps)*w
inv=theta**(-np.arange(0,hd,2)/hd)
pos=np.arange(T)[:,None]*inv[None,:]
cos,sin=np.cos(pos),np.sin(pos)
def rope(x):  # x [T, heads, hd], adjacent pairs
    x0=x[...,0::2]; x1=x[...,1::2]
    c=cos[:,None,:]; s=sin[:,None,:]
    out=np.empty_like(x); out[...,0::2]=x0*c-x1*s; out[...,1::2]=x0*s+x1*c; return out
x=W['token_embd.weight'][ids]
for l in range(L):
    p=f'blk.{l}.'
    h=rms(x,W[p+'attn_norm.weight'])
    q=(h@W[p+'attn_q.weight'].T).reshape(T,nh,hd); k=(h@W[p+'attn_k.weight'].T).reshape(T,nkv,hd); v=(h@W[p+'attn_v.weight'].T).reshape(T,nkv,hd)
    q=rope(q); k=rope(k)
    out=np.zeros((T,nh,hd))
    for hh in range(nh):
        kv=hh//(nh//nkv)
        s=q[:,hh,:]@k[:,kv,:].T/np.sqrt(hd)
        s=s+np.triu(np.full((T,T),-np.inf),1)
        s=np.exp(s-s.max(-1,keepdims=True)); s/=s.sum(-1,keepdims=True)
        out[:,hh,:]=s@v[:,kv,:]
    x=x+out.reshape(T,H)@W[p+'attn_output.weight'].T
    h=rms(x,W[p+'ffn_norm.weight'])
    g=h@W[p+'ffn_gate.weight'].T; u=h@W[p+'ffn_up.weight'].T
    x=x+((g/(1+np.exp(-g)))*u)@W[p+'ffn_down.weight'].T
x=rms(x,W['output_norm.weight'])
logits=x@W['token_embd.weight'].T
llm=llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True, n_threads=2, n_threads_batch=2, type_k=0, type_v=0, flash_attn=False, seed=0, verbose=False)
llm.eval(ids); a=np.array(llm.scores[:T],dtype=np.float64)
t=np.load("/tmp/t.npy").astype(np.float64) if os.path.exists("/tmp/t.npy") else a
def nmse(x,y): return float(((x-y)**2).sum()/(y**2).sum())
print("float64 vs llama.cpp per pos:", [f"{nmse(logits[r],a[r]):.1e}" for r in range(0,T,5)])
print("float64 vs tessera per pos:", [f"{nmse(logits[r],t[r]):.1e}" for r in range(0,T,5)])
print("all: float-llama", nmse(logits,a), "tessera-llama", nmse(t,a), "last4 float", nmse(logits[-4:],a[-4:]), "last4 tessera", nmse(t[-4:],a[-4:]))
print("argmax agree float/llama", (logits.argmax(1)==a.argmax(1)).mean(), "tessera/llama", (t.argmax(1)==a.argmax(1)).mean())
