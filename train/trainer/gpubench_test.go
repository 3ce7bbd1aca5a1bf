package trainer

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"distill/compute"
	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/model/decoder"
	"distill/train"
	"distill/train/loss"
	"distill/train/optim"
)

// trainShape is a GPU training benchmark's Qwen3-shaped student.
type trainShape struct {
	Name                                 string
	Hidden, Layers, Heads, KV, HD, Inter int
}

// config is the student's model config over a vocabulary of V.
func (sh trainShape) config(V int) *model.Config {
	return &model.Config{Arch: model.ArchQwen3, VocabSize: V, Hidden: sh.Hidden, Layers: sh.Layers, Heads: sh.Heads, KVHeads: sh.KV,
		HeadDim: sh.HD, Intermediate: sh.Inter, MaxPositions: 40960, RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true, TieEmbeddings: true}
}

// benchCUDA opens the GPU backend of one benchmark case (closed when the
// case ends) with the pool's high-water mark restarted for it: the cases
// before it freed their memory.
func benchCUDA(b *testing.B) *cuda.Backend {
	kc := os.Getenv("DISTILL_KERNEL_CACHE")
	if kc == "" {
		kc = b.TempDir()
	}
	be, err := cuda.Open(cuda.Options{KernelCache: kc})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { be.Close() })
	be.ResetPeakMemory()
	return be
}

// trainShapes are the GPU training benchmark's students: Qwen3-0.6B and
// Qwen3-1.7B shapes (tied embeddings, vocab 151936), random weights.
var trainShapes = []trainShape{
	{"qwen3-0.6b", 1024, 28, 16, 8, 128, 3072},
	{"qwen3-1.7b", 2048, 28, 16, 8, 128, 6144},
}

// benchPeak is the dense BF16 peak in TFLOP/s of the GPU named name
// (DISTILL_PEAK_TFLOPS overrides), 0 if unknown.
func benchPeak(name string) float64 {
	if v, err := strconv.ParseFloat(os.Getenv("DISTILL_PEAK_TFLOPS"), 64); err == nil {
		return v
	}
	n := strings.ToUpper(name)
	switch {
	case strings.Contains(n, "H100") && strings.Contains(n, "PCIE"):
		return 756
	case strings.Contains(n, "H100"), strings.Contains(n, "H200"), strings.Contains(n, "H800"):
		return 989.4
	case strings.Contains(n, "A100"):
		return 312
	}
	return 0
}

// benchTrainShapes are the training benchmarks' students, row length,
// vocabulary and k: trainShapes at 8192 tokens on a GPU; without one a
// tiny student on the emulator when DISTILL_TRAIN_BENCH_DRYRUN=1 (a dry
// run of the benchmark's code), else the benchmark skips.
func benchTrainShapes(b *testing.B) (shapes []trainShape, T, V, K int) {
	if cudaemu.OnGPU() {
		return trainShapes, 8192, 151936, 64
	}
	if os.Getenv("DISTILL_TRAIN_BENCH_DRYRUN") != "1" {
		b.Skip("the training benchmark needs a GPU: set DISTILL_CUDA_TEST=gpu (scripts/gpu-suite.sh); DISTILL_TRAIN_BENCH_DRYRUN=1 runs its code on the emulator with a tiny shape")
	}
	cudaemu.Use(b)
	shapes = append(shapes, trainShape{"tiny", 64, 2, 4, 2, 16, 128})
	return shapes, 128, 1000, 64 // rows of one sample of 128 tokens: a power of two, so cuDNN's fixed-length graph, as 8192 on a GPU
}

// BenchmarkCUDATrainStep times whole training steps of Qwen3-0.6B- and
// 1.7B-shaped students on the GPU: rows of 8192 tokens
// (DISTILL_TRAIN_ROWS rows a step, default 1), vocab 151936, k = 64 KD
// (forward KL, bucket tail) plus 0.1 CE, then gradient clipping and AdamW;
// with and without NVFP4 QAD, under DISTILL_TRAIN_RECOMPUTE (none by
// default, selective or full). It reports tokens/s, MFU (6 × params +
// attention FLOPs per token, against the dense BF16 peak), the device
// memory in use (the pool's peak during the case) and the memory plan's
// total beside it (devmem_GiB, plan_GiB); with DISTILL_BENCH_OUT set it appends one JSON line per
// case to train-bench.jsonl there and writes the top kernels of one
// profiled step to profile-train-<shape>[-qad].txt. It needs a GPU
// (DISTILL_CUDA_TEST=gpu, scripts/gpu-suite.sh).
func BenchmarkCUDATrainStep(b *testing.B) {
	shapes, T, V, K := benchTrainShapes(b)
	rows := 1
	if v, err := strconv.Atoi(os.Getenv("DISTILL_TRAIN_ROWS")); err == nil && v > 0 {
		rows = v
	}
	recompute := decoder.RecomputeNone
	if v := os.Getenv("DISTILL_TRAIN_RECOMPUTE"); v != "" {
		r, err := decoder.ParseRecompute(v)
		if err != nil {
			b.Fatal(err)
		}
		recompute = r
	}
	only := os.Getenv("DISTILL_BENCH_SHAPES")
	outDir := os.Getenv("DISTILL_BENCH_OUT")
	for _, sh := range shapes {
		if only != "" && !strings.Contains(only, sh.Name) {
			continue
		}
		for _, qad := range []bool{false, true} {
			name := sh.Name
			if qad {
				name += "-qad"
			}
			if recompute != decoder.RecomputeNone {
				name += "-" + string(recompute)
			}
			b.Run(fmt.Sprintf("%s/rows_%dx%d", name, rows, T), func(b *testing.B) {
				be := benchCUDA(b)
				cfg := sh.config(V)
				s, err := train.NewStudentOn(cfg, be)
				if err != nil {
					b.Fatal(err)
				}
				// Device memory is not the garbage collector's: a case
				// that kept its student would leave the next one less
				// (the 1.7B QAD case ran out of memory after the three
				// cases before it had kept theirs).
				defer s.Free()
				if err := s.Model.SetRecompute(recompute); err != nil {
					b.Fatal(err)
				}
				r := rand.New(rand.NewPCG(1, 2))
				params := loadBenchWeights(b, s, r)
				bt := benchBatch(r, rows, T, V, K)
				opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
				if qad {
					if err := s.EnableQAD(); err != nil {
						b.Fatal(err)
					}
					if _, err := s.Forward(bt, &opt); err != nil {
						b.Fatal(err)
					}
					if err := s.FinishCalibration(); err != nil {
						b.Fatal(err)
					}
				}
				ad, err := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1}, s.Groups())
				if err != nil {
					b.Fatal(err)
				}
				defer ad.Free()
				// The loss head keeps its logits between its passes where the
				// plan has room for them on this device, as the trainer's
				// check before step 1 decides (DISTILL_CUDA_RECOMPUTE_LOGITS=1:
				// never, the comparison's variant).
				shape := train.PlanShape{Model: cfg, RowTokens: rows * T, K: K, QAD: qad, Recompute: recompute, Activations: be.ActDType(),
					AttnWorkspace: be.AttentionWorkspaceBytes(rows, T, cfg.Heads, cfg.KVHeads, cfg.HeadDim)}
				_, total := be.MemInfo()
				_, fits := train.KeepLogitsFit(shape, total-train.DeviceReserve(total))
				shape.KeepLogits = fits && os.Getenv("DISTILL_CUDA_RECOMPUTE_LOGITS") != "1"
				s.SetKeepLogits(shape.KeepLogits)
				// A step as the trainer runs it: the row's loss read after
				// the norm, the step's one host wait (TestCUDAHostWaits).
				step := func() float64 {
					s.ZeroGrad()
					st, err := s.ForwardBackwardPending(bt, &opt, 0)
					if err != nil {
						b.Fatal(err)
					}
					optim.ClipGradNorm(ad.Groups, 1) // synchronizes (SumSquares)
					ad.Step(1e-4)
					return st.Stats().Loss
				}
				step() // warm up: kernels, plans, the memory pool
				b.ResetTimer()
				t0 := time.Now()
				var lossV float64
				for i := 0; i < b.N; i++ {
					lossV = step()
				}
				sec := time.Since(t0).Seconds() / float64(b.N)
				b.StopTimer()
				tokens := float64(rows * T)
				// 6 × params per token (the embedding lookup is no matmul,
				// but the tied head is: params counts it once), plus the
				// attention matmuls: QKᵀ and PV, 2 FLOPs a multiply-add,
				// causal half, forward ×3 for the backward.
				attn := 3 * 2 * 2 * float64(sh.Layers*sh.Heads*sh.HD) * float64(T) * float64(T+1) / 2 * float64(rows)
				flops := 6*float64(params)*tokens + attn
				peak := benchPeak(be.Info().Name)
				// The host waits of one more step, by kind and call site
				// (cuda.HostWait): what leaves the GPU idle between kernels.
				be.CountHostWaits(true)
				step()
				waits := be.HostWaits()
				be.CountHostWaits(false)
				nWaits := 0
				for _, w := range waits {
					nWaits += w.Count
				}
				b.ReportMetric(tokens/sec, "tokens/s")
				b.ReportMetric(flops/sec/1e12, "TFLOP/s")
				b.ReportMetric(float64(nWaits), "host_waits")
				if peak > 0 {
					b.ReportMetric(100*flops/sec/1e12/peak, "MFU%")
				}
				// One more step, its phases timed apart (each ends in a
				// synchronization): where a step's wall time goes beside
				// the kernels' (ForwardBackward ends reading its loss back;
				// the clip reads the norm; AdamW is waited for here).
				one := be.New(compute.F32, 1)
				host := make([]float32, 1)
				s.ZeroGrad()
				p0 := time.Now()
				if _, err := s.ForwardBackward(bt, &opt, 0); err != nil {
					b.Fatal(err)
				}
				be.ReadF32(one, host)
				p1 := time.Now()
				optim.ClipGradNorm(ad.Groups, 1)
				p2 := time.Now()
				ad.Step(1e-4)
				be.ReadF32(one, host)
				p3 := time.Now()
				be.Free(one)
				fbMS, clipMS, adamMS := 1e3*p1.Sub(p0).Seconds(), 1e3*p2.Sub(p1).Seconds(), 1e3*p3.Sub(p2).Seconds()
				b.ReportMetric(fbMS, "fb_ms")
				b.ReportMetric(clipMS, "clip_ms")
				b.ReportMetric(adamMS, "adamw_ms")
				devmem := float64(be.PeakMemory()) / (1 << 30) // the pool's high-water mark since the case began
				b.ReportMetric(devmem, "devmem_GiB")
				ws := be.AttentionWorkspaceBytes(rows, T, cfg.Heads, cfg.KVHeads, cfg.HeadDim) // the plans the steps built
				b.ReportMetric(float64(ws)/(1<<20), "attn_ws_MiB")
				shape.AttnWorkspace = ws
				plan := train.PlanMemory(shape)
				b.ReportMetric(float64(plan.Total())/(1<<30), "plan_GiB")
				if outDir == "" {
					return
				}
				res := map[string]any{"shape": sh.Name, "qad": qad, "rows": rows, "row_tokens": T, "vocab": V, "k": K, "params": params,
					"tokens_per_s": tokens / sec, "step_s": sec, "tflops": flops / sec / 1e12,
					"devmem_GiB": devmem, "plan_GiB": float64(plan.Total()) / (1 << 30), "recompute": recompute, "loss": lossV, "gpu": be.Info().Name,
					"fb_ms": fbMS, "clip_ms": clipMS, "adamw_ms": adamMS, "attention": be.AttentionImpl(), "attn_workspace_bytes": ws,
					"host_waits": nWaits, "keep_logits": shape.KeepLogits}
				if peak > 0 {
					res["mfu_pct"] = 100 * flops / sec / 1e12 / peak
				}
				line, err := json.Marshal(res)
				if err != nil {
					b.Fatal(err)
				}
				f, err := os.OpenFile(filepath.Join(outDir, "train-bench.jsonl"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
				if err == nil {
					fmt.Fprintf(f, "%s\n", line)
					f.Close()
				}
				be.SetProfile(true)
				q0 := time.Now()
				step()
				q1 := time.Now()
				tl := be.HostTimeline()
				prof := be.Profile()
				span := be.ProfileSpan()
				be.SetProfile(false)
				var sum float64
				for _, e := range prof {
					sum += e.Time.Seconds()
				}
				var sb strings.Builder
				fmt.Fprintf(&sb, "%s training step (%d x %d tokens, k=%d): one profiled step, %.1f ms in kernels over a span of %.1f ms (the GPU idle %.1f ms between them); %d host waits a step\n",
					name, rows, T, K, 1e3*sum, 1e3*span.Seconds(), 1e3*(span.Seconds()-sum), nWaits)
				fmt.Fprintln(&sb, tl.Describe("step", q0, q1))
				for _, w := range waits {
					fmt.Fprintf(&sb, "host wait: %v\n", w)
				}
				for i, e := range prof {
					if i == 20 {
						break
					}
					fmt.Fprintf(&sb, "%6.1f%% %9.2f ms %6d calls  %s\n", 100*e.Time.Seconds()/sum, 1e3*e.Time.Seconds(), e.Calls, e.Name)
				}
				// The BF16 rounding passes, in or out of the top 20: what
				// writing the gradients GEMMs read in BF16 saves
				// (DISTILL_CUDA_F32_GRADS=1 restores the passes).
				var convCalls int
				var convTime float64
				for _, e := range prof {
					if strings.HasPrefix(e.Name, "k_f32_to_bf16") {
						convCalls, convTime = convCalls+e.Calls, convTime+e.Time.Seconds()
					}
				}
				fmt.Fprintf(&sb, "rounding passes (k_f32_to_bf16*): %d calls, %.2f ms\n", convCalls, 1e3*convTime)
				os.WriteFile(filepath.Join(outDir, "profile-train-"+name+".txt"), []byte(sb.String()), 0o644)
			})
		}
	}
}

// loadBenchWeights loads random weights into s without drawing billions
// of numbers: every tensor takes a prefix of one buffer of U(±0.035)
// values (std 0.02), norms included (timing does not care). It returns
// the parameter count.
func loadBenchWeights(b *testing.B, s *train.Student, r *rand.Rand) (params int) {
	b.Helper()
	maxN := 0
	for _, t := range s.Tensors {
		maxN, params = max(maxN, t.N), params+t.N
	}
	seed := make([]float32, 1<<20)
	for i := range seed {
		seed[i] = float32((r.Float64()*2 - 1) * 0.035)
	}
	buf := make([]float32, maxN)
	for i := 0; i < maxN; i += len(seed) {
		copy(buf[i:], seed)
	}
	w := map[string][]float32{}
	for _, t := range s.Tensors {
		w[t.Name] = buf[:t.N]
	}
	if err := s.Load(w); err != nil {
		b.Fatal(err)
	}
	return params
}

// BenchmarkCUDATrainStepZeRO times the training step of a sharded
// student (ZeRO stages 2 and 3, DISTILL_BENCH_ZERO to choose) on a real
// NCCL group of one rank (DISTILL_LIBNCCL or PyTorch's wheel), against
// the same student unsharded in the same run: the collectives' and the
// sharded layout's overhead at world size 1 (issue 25's target: 3% or
// less), and the device memory against the memory plan of that layout;
// each stage with and without Sharding.Overlap (the collectives on the
// second stream: at world size 1 NCCL's own cost stays, so the figure
// shows the overlap's overhead, not what it hides across GPUs).
// Shapes as BenchmarkCUDATrainStep (DISTILL_BENCH_SHAPES), one row of
// 8192 tokens, no QAD. It needs a GPU (DISTILL_CUDA_TEST=gpu) and NCCL;
// on the emulator (DISTILL_TRAIN_BENCH_DRYRUN=1) a tiny shape runs on its
// NCCL stand-in.
//
// Each case times b.N steps one by one (each ends at a synchronization:
// the gradient norm's) and reports the median step; the unsharded step
// runs first and again last, and overhead_% is against the mean of the
// two medians (base_drift_% on the last: how far the GPU moved between
// them, the figure's own noise floor). -test.benchtime 5x or more.
func BenchmarkCUDATrainStepZeRO(b *testing.B) {
	shapes, T, V, K := benchTrainShapes(b)
	stages := []int{2, 3}
	if v := os.Getenv("DISTILL_BENCH_ZERO"); v != "" {
		stages = nil
		for _, f := range strings.Split(v, ",") {
			z, err := strconv.Atoi(f)
			if err != nil || z < 2 || z > 3 {
				// Stages 0 and 1 keep the student whole: the unsharded
				// step every run times first and last is their figure.
				b.Fatalf("DISTILL_BENCH_ZERO=%q: want stages 2 and 3 (comma separated); the unsharded step, timed in every run, is stages 0 and 1", v)
			}
			stages = append(stages, z)
		}
	}
	only := os.Getenv("DISTILL_BENCH_SHAPES")
	sharded, order := map[string]float64{}, []string(nil)
	for _, sh := range shapes {
		if only != "" && !strings.Contains(only, sh.Name) {
			continue
		}
		cfg := sh.config(V)
		// The unsharded step's median seconds (first, again) and the
		// sharded cases', this run. The testing package runs a case with
		// b.N = 1 before its timed run: the last run of a case wins.
		bases := map[bool]float64{}
		type run struct {
			stage   int // -1: unsharded
			overlap bool
			again   bool // the unsharded step after the sharded ones
		}
		runs := []run{{-1, false, false}}
		for _, z := range stages {
			runs = append(runs, run{z, false, false}, run{z, true, false})
		}
		runs = append(runs, run{-1, false, true})
		for _, rn := range runs {
			stage := rn.stage
			name := fmt.Sprintf("%s/zero%d", sh.Name, stage)
			if stage < 0 {
				name = sh.Name + "/unsharded"
				if rn.again {
					name += "-again"
				}
			} else if rn.overlap {
				name += "-overlap"
			}
			b.Run(name, func(b *testing.B) {
				be := benchCUDA(b)
				var s *train.Student
				var err error
				if stage < 0 {
					s, err = train.NewStudentOn(cfg, be)
				} else {
					id, ierr := be.NewCollectiveID()
					if ierr != nil {
						b.Fatalf("NCCL: %v", ierr)
					}
					c, jerr := be.JoinCollective(id, 0, 1)
					if jerr != nil {
						b.Fatalf("NCCL: %v", jerr)
					}
					defer c.Close()
					s, err = train.NewShardedStudentOn(cfg, be, train.Sharding{C: c, Stage: stage, Overlap: rn.overlap})
				}
				if err != nil {
					b.Fatal(err)
				}
				defer s.Free()
				r := rand.New(rand.NewPCG(1, 2))
				loadBenchWeights(b, s, r)
				bt := benchBatch(r, 1, T, V, K)
				opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
				ad, err := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1}, s.Groups())
				if err != nil {
					b.Fatal(err)
				}
				defer ad.Free()
				step := func() {
					s.ZeroGrad()
					if _, err := s.ForwardBackward(bt, &opt, 0); err != nil {
						b.Fatal(err)
					}
					if stage >= 0 {
						s.AllReduceGrads(nil)
					}
					optim.ClipGradNorm(ad.Groups, 1) // synchronizes
					ad.Step(1e-4)
					s.AfterStep()
				}
				step() // warm up
				b.ResetTimer()
				steps := make([]float64, b.N)
				for i := range steps {
					t0 := time.Now()
					step()
					steps[i] = time.Since(t0).Seconds()
				}
				b.StopTimer()
				sec := medianOf(steps)
				b.ReportMetric(float64(T)/sec, "tokens/s")
				b.ReportMetric(1e3*sec, "median_step_ms")
				if stage < 0 {
					if first, ok := bases[false]; rn.again && ok {
						b.ReportMetric(100*(sec/first-1), "base_drift_%")
					}
					bases[rn.again] = sec
				}
				b.ReportMetric(float64(be.PeakMemory())/(1<<30), "devmem_GiB")
				ps := train.PlanShape{Model: cfg, RowTokens: T, K: K, Recompute: decoder.RecomputeNone, Activations: be.ActDType(),
					AttnWorkspace: be.AttentionWorkspaceBytes(1, T, cfg.Heads, cfg.KVHeads, cfg.HeadDim)}
				if stage >= 0 {
					ps.Ranks, ps.ZeRO, ps.Overlap = 1, stage, rn.overlap
				}
				b.ReportMetric(float64(train.PlanMemory(ps).Total())/(1<<30), "plan_GiB")
				if stage >= 0 {
					if _, ok := sharded[name]; !ok {
						order = append(order, name)
					}
					sharded[name] = sec
				}
			})
		}
		// The overheads, once both unsharded medians are in: against
		// their mean, one line per sharded case.
		if len(bases) > 0 {
			var base float64
			var ms []float64
			for _, again := range []bool{false, true} {
				if v, ok := bases[again]; ok {
					base += v / float64(len(bases))
					ms = append(ms, math.Round(1e5*v)/100)
				}
			}
			for _, name := range order {
				sec := sharded[name]
				fmt.Printf("ZeRO overhead %s: %.2f%% (median step %.2f ms against the unsharded %.2f ms, the mean of %v ms)\n",
					name, 100*(sec/base-1), 1e3*sec, 1e3*base, ms)
			}
		}
		clear(sharded)
		order = order[:0]
	}
}

// medianOf is the median of xs (the mean of the middle two for an even
// count); xs is sorted in place.
func medianOf(xs []float64) float64 {
	slices.Sort(xs)
	n := len(xs)
	if n == 0 {
		return 0
	}
	if n%2 == 1 {
		return xs[n/2]
	}
	return (xs[n/2-1] + xs[n/2]) / 2
}

// benchBatch is rows packed rows of T tokens (one sample each, every
// position counted) with K distinct random teacher ids a position and
// decreasing log-probs.
func benchBatch(r *rand.Rand, rows, T, V, K int) *train.Batch {
	N := rows * T
	bt := &train.Batch{Tokens: make([]int32, N), Mask: make([]uint8, N), K: K, TopIDs: make([]int32, N*K), TopLP: make([]float32, N*K)}
	for i := 0; i <= rows; i++ {
		bt.Starts = append(bt.Starts, int32(i*T))
	}
	seen := map[int32]bool{}
	for t := 0; t < N; t++ {
		bt.Tokens[t] = int32(r.IntN(V))
		bt.Mask[t] = 1
		clear(seen)
		for j := 0; j < K; j++ {
			id := int32(r.IntN(V))
			for seen[id] {
				id = int32(r.IntN(V))
			}
			seen[id] = true
			bt.TopIDs[t*K+j] = id
			bt.TopLP[t*K+j] = float32(-2 - 0.1*float64(j))
		}
	}
	return bt
}
