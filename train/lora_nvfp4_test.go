package train

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand"
	"slices"
	"strings"
	"testing"

	"distill/compute"
	"distill/model"
	"distill/train/loss"
)

// TestLoRAMergedNVFP4: a LoRA student's merged NVFP4 export (fp32 base,
// and the NVFP4-held base of quant: nvfp4).
//   - The inputs' amax calibrated at the start (B zero) are those QAD's
//     calibration finds for a full student of the same (held) base, bit
//     for bit.
//   - With trained adapters (B non-zero), the export decoded from its
//     bytes (E2M1 codes, E4M3 block scales and weight_scale_2, decoded by
//     this package's own e2m1 and e4m3) equals NVFP4's fake quantization
//     (compute.NVFP4FakeQuantBlock) of the merged fp32 weights
//     MergedWeights returns, with weight amax max |W'| shared by q/k/v and
//     by gate/up, bit for bit; input_scale is the calibrated amax/(6·448);
//     ExportNVFP4's packed weights dequantize to the same.
//   - A student whose inputs were never calibrated is refused with
//     ErrNoInputAmax.
func TestLoRAMergedNVFP4(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3, false)
	w := model.Init(cfg, model.InitOptions{Seed: 6, Std: 0.2, Perturb: true})
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.5}
	b := testBatch(8, cfg.VocabSize, 4)
	for _, q := range []bool{false, true} {
		t.Run(fmt.Sprintf("nvfp4base=%v", q), func(t *testing.T) {
			s := newLoRA(t, cfg, w, LoRAConfig{Rank: 4, Alpha: 8, Targets: allTargets, Seed: 2, NVFP4: q})
			defer s.Free()
			if err := s.WriteNVFP4(t.TempDir()); !errors.Is(err, ErrNoInputAmax) {
				t.Fatalf("NVFP4 export without calibrated inputs: %v, want ErrNoInputAmax", err)
			}
			if err := s.StartInputCalibration(); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Forward(b, &opt); err != nil {
				t.Fatal(err)
			}
			if err := s.FinishInputCalibration(); err != nil {
				t.Fatal(err)
			}
			in := s.InputAmax()

			// QAD's calibration of the same base.
			full, err := NewStudent(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer full.Free()
			if err := full.Load(s.baseWeights()); err != nil {
				t.Fatal(err)
			}
			calibrateQAD(t, full, &opt, b)
			qa := full.QuantAmax()
			for l := 0; l < cfg.Layers; l++ {
				if got, want := in[4*l:4*l+4], qa[11*l+7:11*l+11]; !slices.Equal(got, want) {
					t.Fatalf("layer %d: input amax %v, QAD's calibration %v", l, got, want)
				}
			}

			// Trained adapters.
			rng := rand.New(rand.NewSource(9))
			ad := map[string][]float32{}
			sw := s.Weights()
			for _, ts := range s.Tensors { // in order: the draws do not depend on a map's
				name, v := ts.Name, slices.Clone(sw[ts.Name])
				if strings.HasSuffix(name, "lora_B.weight") {
					for i := range v {
						v[i] = float32(rng.NormFloat64() * 0.3)
					}
				}
				ad[name] = v
			}
			if err := s.Load(ad); err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			if err := s.WriteNVFP4(dir); err != nil {
				t.Fatal(err)
			}
			merged := s.MergedWeights()
			packed, inScale, err := s.ExportNVFP4()
			if err != nil {
				t.Fatal(err)
			}
			rd, err := model.OpenWeights(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer rd.Close()
			absmax := func(names ...string) float32 {
				var a float32
				for _, n := range names {
					for _, x := range merged[n+".weight"] {
						a = max(a, float32(math.Abs(float64(x))))
					}
				}
				return a
			}
			for l := 0; l < cfg.Layers; l++ {
				p := fmt.Sprintf("model.layers.%d.", l)
				qkv := []string{p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"}
				gu := []string{p + "mlp.gate_proj", p + "mlp.up_proj"}
				for _, c := range []struct {
					lins []string
					in   float32
				}{{qkv, in[4*l]}, {[]string{p + "self_attn.o_proj"}, in[4*l+1]}, {gu, in[4*l+2]}, {[]string{p + "mlp.down_proj"}, in[4*l+3]}} {
					amax := absmax(c.lins...)
					g := compute.NVFP4GlobalScale(amax)
					for _, lin := range c.lins {
						W := merged[lin+".weight"]
						info, _ := rd.Info(lin + ".weight")
						rows, cols := info.Shape[0], 2*info.Shape[1]
						want := make([]float32, len(W))
						for r := 0; r < rows; r++ {
							for k := 0; k < cols; k += compute.NVFP4BlockSize {
								compute.NVFP4FakeQuantBlock(want[r*cols+k:r*cols+k+compute.NVFP4BlockSize], W[r*cols+k:r*cols+k+compute.NVFP4BlockSize], g)
							}
						}
						raw, _, err := rd.Raw(lin + ".weight")
						if err != nil {
							t.Fatal(err)
						}
						sc, _, _ := rd.Raw(lin + ".weight_scale")
						g2raw, _, _ := rd.Raw(lin + ".weight_scale_2")
						inraw, _, _ := rd.Raw(lin + ".input_scale")
						g2 := math.Float32frombits(binary.LittleEndian.Uint32(g2raw))
						if g2 != amax/(6*448) {
							t.Fatalf("%s weight_scale_2 %g, want max |W'| of its group / 2688 = %g", lin, g2, amax/2688)
						}
						if got := math.Float32frombits(binary.LittleEndian.Uint32(inraw)); got != c.in/(6*448) || inScale[lin] != got {
							t.Fatalf("%s input_scale %g (ExportNVFP4 %g), want %g", lin, got, inScale[lin], c.in/2688)
						}
						deq := packed[lin].Dequantize()
						changed := 0
						for r := 0; r < rows; r++ {
							for k := 0; k < cols; k++ {
								byt := raw[(r*cols+k)/2]
								code := byt & 15
								if k%2 == 1 {
									code = byt >> 4
								}
								got := float32(e2m1(code)) * (float32(e4m3(sc[r*(cols/16)+k/16])) * g2)
								i := r*cols + k
								if got != want[i] && !(got == 0 && want[i] == 0) || deq[i] != got && !(deq[i] == 0 && got == 0) {
									t.Fatalf("%s[%d,%d]: export decodes to %g (ExportNVFP4 %g), fake quantization of the merged weight %g is %g", lin, r, k, got, deq[i], W[i], want[i])
								}
								if got != W[i] {
									changed++
								}
							}
						}
						if changed == 0 {
							t.Fatalf("%s: the export equals the merged fp32 weights: nothing was quantized", lin)
						}
					}
				}
			}
		})
	}
}
