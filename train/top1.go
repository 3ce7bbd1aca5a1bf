package train

// Top1 runs the forward over b and returns the student's most likely next
// token at every position (N), ties to the lowest id, with its log-prob
// normalized over the full vocabulary: Predict and the confidence the
// expected calibration error bins.
func (s *Student) Top1(b *Batch) ([]int32, []float32, error) {
	lnf, err := s.forward(b, nil)
	if err != nil {
		return nil, nil, err
	}
	ids, lps := s.headTopK(lnf, len(b.Tokens), 1)
	return ids, lps, nil
}
